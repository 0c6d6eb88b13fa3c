"""Known Apple chips and the GPU facts MLX keys its kernels on.

A simulated rank is named by chip ("Apple M3 Ultra"); the catalog supplies
what a probe would have read from `mx.device_info()` on that machine. The GPU
architecture string is `applegpu_g<generation><suffix>`: suffix `g` base,
`s` Pro, `c` Max, `d` Ultra, `p` phone.
"""

from dataclasses import dataclass

from mlxserve.errors import UsageError


@dataclass(frozen=True)
class ChipFacts:
    name: str
    gpu_generation: int
    gpu_suffix: str

    @property
    def gpu_architecture(self) -> str:
        return f"applegpu_g{self.gpu_generation}{self.gpu_suffix}"


_TIERS = {"": "g", " Pro": "s", " Max": "c", " Ultra": "d"}
_FAMILIES = {
    "M1": (13, ["", " Pro", " Max", " Ultra"]),
    "M2": (14, ["", " Pro", " Max", " Ultra"]),
    "M3": (15, ["", " Pro", " Max", " Ultra"]),
    "M4": (16, ["", " Pro", " Max"]),
    "M5": (17, ["", " Pro", " Max", " Ultra"]),
}


def known_chips() -> dict[str, ChipFacts]:
    """Every chip the catalog knows, keyed by its marketing name."""
    chips: dict[str, ChipFacts] = {}
    for family, (generation, tiers) in _FAMILIES.items():
        for tier in tiers:
            name = f"Apple {family}{tier}"
            chips[name] = ChipFacts(name, generation, _TIERS[tier])
    return chips


def lookup_chip(name: str) -> ChipFacts:
    """Facts for a chip name; case and the "Apple " prefix are optional."""
    wanted = " ".join(name.split()).lower()
    if not wanted.startswith("apple "):
        wanted = "apple " + wanted
    for chip_name, facts in known_chips().items():
        if chip_name.lower() == wanted:
            return facts
    choices = ", ".join(known_chips())
    raise UsageError(f"unknown chip {name!r}; known chips: {choices}")


def parse_gpu_architecture(arch: str) -> tuple[int, str] | None:
    """(generation, suffix) from e.g. "applegpu_g17s"; None when not an Apple GPU."""
    prefix = "applegpu_g"
    if not arch.startswith(prefix):
        return None
    body = arch[len(prefix) :]
    digits = "".join(ch for ch in body if ch.isdigit())
    if not digits:
        return None
    return int(digits), body[len(digits) :]
