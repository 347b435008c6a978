"""LightningCLI with errors that come first and short, and a progress bar that counts steps (:class:`MTrainingCLI`).

A misspelled key, a value of the wrong type or a bad strategy argument makes Lightning's CLI print its usage text (60
lines and more) before the error, or a traceback whose message sits in its middle. Here the error comes first, in a
few lines, with the nearest valid key for an unknown one, and the process exits with status 2, as argparse does.
Imports jsonargparse (through Lightning's CLI): import this module only where a CLI runs.
"""

from __future__ import annotations

import difflib
import re
import sys
from typing import Any, NoReturn

from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

__all__ = ["MTrainingCLI", "compact_cli_error"]

MAX_LINES = 15
_UNKNOWN = re.compile(r"(?:does not accept (?:nested )?(?:option|key)s? '?|unrecognized arguments: -*)([\w.\-]+)")
_KEY = re.compile(r'Parser key "([\w.\-]+)"')


def _keys(parser: Any) -> list[str]:
    """Every option key of ``parser`` and its subcommand parsers (``trainer.max_steps``, ``data.seq_len``, ...)."""
    keys: list[str] = []
    for action in getattr(parser, "_actions", []):
        keys += [s.lstrip("-") for s in action.option_strings if s.startswith("--") and s.lstrip("-") not in keys]
        for sub in (getattr(action, "choices", None) or {}).values() if hasattr(action, "_name_parser_map") else ():
            keys += [k for k in _keys(sub) if k not in keys]
    return keys


def compact_cli_error(message: str, keys: list[str], prog: str) -> list[str]:
    """The lines to print for a CLI error ``message``: the error first, the nearest of ``keys`` for an unknown one
    (or the valid keys under its section), what the value was and what was expected, without the usage text or the
    values of every other argument; at most :data:`MAX_LINES`."""
    lines = [ln.rstrip() for ln in message.strip().splitlines() if ln.strip()]
    # union errors list each alternative; keep the informative ones (not "Expected a <class 'str'>" for a class
    # path given as a mapping), and never the dump of the given value
    lines = [ln for ln in lines if not ln.strip().startswith(("Given value", "Subtypes:"))]
    specific = [ln.strip()[2:] for ln in lines if ln.strip().startswith("- ") and "Expected a <class" not in ln]
    out = ["error: " + (specific[-1] if specific else lines[0] if lines else "invalid arguments")]
    if not specific:
        out += ["  " + ln.strip() for ln in lines[1:4]]
    found = _UNKNOWN.search(message)
    if found:
        bad = found.group(1)
        near = difflib.get_close_matches(bad, list(dict.fromkeys(keys)), n=3, cutoff=0.6)
        if near:
            out.append(f"  did you mean {' or '.join(repr(k) for k in near)}?")
        else:
            section = bad.rsplit(".", 1)[0]
            under = sorted({k for k in keys if k.startswith(section + ".")})[:8]
            if under:
                out.append(f"  keys under {section!r}: {', '.join(under)}")
    out.append(f"  (`{prog} --help` lists every option)")
    return out[:MAX_LINES]


class _CompactParser(LightningArgumentParser):
    """Lightning's parser, reporting errors with :func:`compact_cli_error` instead of the usage text."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        sub = getattr(ex, "subcommand_parser", None) or self
        lines = compact_cli_error(message, _keys(self) + _keys(sub), sub.prog.replace(" [options]", ""))
        sys.stderr.write("\n".join(lines) + "\n")
        self.exit(2)


class MTrainingCLI(LightningCLI):
    """``LightningCLI`` whose argument and configuration errors come first and short (see the module docstring): an
    unknown key with its nearest valid one, a wrong type with the value and the expected type, a strategy argument's
    own message (e.g. a bad ``sparsity`` string) without the traceback; exit status 2. Where the config names no
    progress bar, the Trainer gets :func:`~lightning_mtraining.callbacks.progress.progress_bar` (a run bounded by
    ``max_steps`` reads ``Epoch 0``, not ``Epoch 0/-2``). Takes LightningCLI's arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", _CompactParser)
        super().__init__(*args, **kwargs)

    def instantiate_trainer(self, **kwargs: Any):
        trainer = self._get(self.config_init, "trainer", default={})
        given = trainer.get("callbacks") or []
        given = given if isinstance(given, list) else [given]
        if trainer.get("enable_progress_bar", True) is not False and not any(isinstance(c, ProgressBar)
                                                                            for c in given):
            from lightning_mtraining.callbacks.progress import progress_bar

            kwargs["callbacks"] = [*given, progress_bar()]
        return super().instantiate_trainer(**kwargs)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as error:  # a class's own check (the strategy, the model, the data)
            prog = " ".join(x for x in (self.parser.prog.replace(" [options]", ""), self.subcommand) if x)
            lines = compact_cli_error(str(error), _keys(self.parser), prog)
            sys.stderr.write("\n".join(lines) + "\n")
            sys.exit(2)
