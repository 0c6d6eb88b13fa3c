"""A tiny random llama checkpoint that both mlxserve and mlx_lm.server can load.

Why: the engine tests of the front (admission, failover, streaming) need a real
model directory, fast on two CPU cores; the demo model's tokenizer is reused so
chat templates and stop tokens behave as with the demo.
"""

import json
import shutil
from pathlib import Path

DEMO_WEIGHTS = Path(__file__).resolve().parents[2] / "mlxserve" / "models" / "demo" / "weights"


def build_tiny_llama(out_dir: Path, seed: int = 0, layers: int = 2) -> Path:
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.utils import save_model

    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 1024,
        "tie_word_embeddings": False,
        "max_position_embeddings": 2048,
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(out_dir, model)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (DEMO_WEIGHTS / name).exists():
            shutil.copyfile(DEMO_WEIGHTS / name, out_dir / name)
    return out_dir
