"""A tiny random llama checkpoint that both mlxserve and mlx_lm.server can load.

Why: the engine tests of the front (admission, failover, streaming) need a real
model directory, fast on two CPU cores; the demo model's tokenizer is reused so
chat templates and stop tokens behave as with the demo.
"""

import json
import shutil
from pathlib import Path

DEMO_WEIGHTS = Path(__file__).resolve().parents[2] / "mlxserve" / "models" / "demo" / "weights"


#: A ChatML template with Hermes-style tool calls (as Qwen2.5's): mlx-lm reads its calls
#: with its ``json_tools`` parser. Another template than the demo's, for the tool tests.
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    'Call a function with <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>'
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{{ message.content or '' }}{%- for call in message.tool_calls %}"
    '{%- set tool_call = call.function %}<tool_call>\n{"name": "{{ tool_call.name }}", '
    '"arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n'
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def with_chat_template(model_dir: Path, template: str) -> Path:
    """The model directory with ``template`` as its tokenizer's chat template."""
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2))
    return model_dir


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
