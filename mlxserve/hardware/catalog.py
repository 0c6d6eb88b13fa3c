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
    memory_bandwidth_gbs: float | None = None
    """Apple's published unified-memory bandwidth (GB/s) of the chip's top configuration;
    None where not published. Decoding reads every weight it uses once per step, so a
    rank's step time scales with bytes over this (see ``policy.split``)."""

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


#: Published memory bandwidth (GB/s) of each chip's top configuration. Binned parts
#: read less (an M3 Max with a 30-core GPU 300, an M4 Max with 32 cores 410), which the
#: catalog cannot tell from the chip name; M5 Ultra is not published.
_BANDWIDTH_GBS = {
    "M1": 68.25,
    "M1 Pro": 200,
    "M1 Max": 400,
    "M1 Ultra": 800,
    "M2": 100,
    "M2 Pro": 200,
    "M2 Max": 400,
    "M2 Ultra": 800,
    "M3": 100,
    "M3 Pro": 150,
    "M3 Max": 400,
    "M3 Ultra": 819,
    "M4": 120,
    "M4 Pro": 273,
    "M4 Max": 546,
    "M5": 153,
    "M5 Pro": 307,
    "M5 Max": 614,
}


def known_chips() -> dict[str, ChipFacts]:
    """Every chip the catalog knows, keyed by its marketing name."""
    chips: dict[str, ChipFacts] = {}
    for family, (generation, tiers) in _FAMILIES.items():
        for tier in tiers:
            name = f"Apple {family}{tier}"
            bandwidth = _BANDWIDTH_GBS.get(f"{family}{tier}")
            chips[name] = ChipFacts(name, generation, _TIERS[tier], bandwidth)
    return chips


def memory_bandwidth_gbs(chip: str) -> float | None:
    """The catalog's bandwidth for a probed or simulated chip name; None when unknown
    (not an Apple chip, or not published)."""
    facts = known_chips().get(" ".join(chip.split()))
    return None if facts is None else facts.memory_bandwidth_gbs


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
