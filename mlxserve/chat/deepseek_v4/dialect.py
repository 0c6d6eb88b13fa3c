# ruff: noqa: RUF001, RUF002, RUF003
"""What DeepSeek-V4 and DeepSeek-V4.1 spell differently in one prompt format.

V4.1 keeps V4's format and changes a few of its strings: the DSML tag names gain a
leading space and the block is named `` calls`` (``<｜DSML｜ calls>``,
``<｜DSML｜ invoke name="...">``, ``<｜DSML｜ parameter ...>``), and system text has
a token of its own (``<｜System｜>``). The encoder, the DSML stream parser and the
forced-call grammar take one of these records instead of module constants, so the
two checkpoints share every line of code and differ only in data. The strings are
those of each release's reference encoder (V4: ``encoding/encoding_dsv4.py``;
V4.1: ``encoding/encoding.py``), as public ports of them spell them (see
``docs/deepseek-v4-flash.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: The marker every DSML tag starts with, in both releases.
DSML = "｜DSML｜"
#: V4.1's token before system text (V4 has none).
SYSTEM = "<｜System｜>"

#: A dialect's name where a forced call's grammar is asked for (`call_grammar.ToolStyle`).
DsmlStyle = Literal["dsml", "dsml_v41"]


@dataclass(frozen=True)
class Dialect:
    """The strings one release spells its way; everything else is shared."""

    #: The forced-call grammar's name for this dialect.
    style: DsmlStyle
    #: The name of the block that holds the calls (after ``<｜DSML｜``).
    calls: str
    #: The name of one call's tag.
    invoke: str
    #: The name of one argument's tag.
    parameter: str
    #: The token before system text; None: system text stands bare (V4). Where there is
    #: one, a system message may also come mid-conversation, and the assistant answers it.
    system_token: str | None

    @property
    def calls_start(self) -> str:
        return f"<{DSML}{self.calls}>"

    @property
    def calls_end(self) -> str:
        return f"</{DSML}{self.calls}>"

    @property
    def invoke_start(self) -> str:
        """The start of a call's tag, up to its ``name`` attribute."""
        return f"<{DSML}{self.invoke}"

    @property
    def invoke_end(self) -> str:
        return f"</{DSML}{self.invoke}>"

    @property
    def parameter_start(self) -> str:
        """The start of an argument's tag, up to its ``name`` attribute."""
        return f"<{DSML}{self.parameter}"

    @property
    def parameter_end(self) -> str:
        return f"</{DSML}{self.parameter}>"


#: DeepSeek-V4 (and -0731): ``<｜DSML｜tool_calls>``, no system token.
V4 = Dialect("dsml", "tool_calls", "invoke", "parameter", system_token=None)
#: DeepSeek-V4.1: ``<｜DSML｜ calls>``, spaced tag names, ``<｜System｜>``.
V4_1 = Dialect("dsml_v41", " calls", " invoke", " parameter", system_token=SYSTEM)
#: Each dialect by its grammar name.
BY_STYLE: dict[DsmlStyle, Dialect] = {V4.style: V4, V4_1.style: V4_1}
