"""The argument parser of a stage command: other spellings of its flags accepted, an unknown flag answered in one line.

Before argparse reads a stage's arguments, each flag is respelled to the stage's own: every flag in its underscore
form (`--ttt_steps` is `--ttt-steps`), and the names speculators, SpecForge and HF Trainer give our settings
(`--learning-rate` is `--lr`; the table: utils/suggest.py). Respelled here rather than registered as argparse
aliases, `--help` lists each setting once (a closing paragraph names the other spellings) and a required flag given
under another name counts as given. A flag the stage does not know is then one line naming the one most likely meant
(`eagle3-train train: error: unknown flag --learnig-rate; did you mean --lr?`, exit 2, as argparse's errors), before
argparse's check of required flags could hide it behind a usage dump.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

from eagle3_train.utils.settings import retired_note
from eagle3_train.utils.suggest import ECOSYSTEM_ALIASES, closest, ecosystem_target, spelling

_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # argparse reads these as values, not options


class StageParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` for a stage (and for its modes: `evaluate offline`, subparsers inherit the class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the CLI's -v after the stage too; unset unless given here, so that one before the stage stands
        self.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")

    def parse_known_args(self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        args = self.respell(list(sys.argv[1:] if args is None else args))
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:  # what the pre-scan could not tell: a single-dash flag, or an argument too many
            flag = next((a for a in extras if _is_option(a)), None)
            if flag is not None:
                self.unknown_flag(flag)
            self.exit(2, f"{self.prog}: error: unexpected argument{'s' * (len(extras) > 1)} {' '.join(extras)} "
                         f"(see {self.prog} --help)\n")
        return namespace, extras

    def respell(self, args: list[str]) -> list[str]:
        """`args` with this parser's flags in its own spelling; stops at the first unknown flag (one line, exit 2)."""
        args = list(args)
        for i in self._option_indices(args):
            name, eq, value = args[i].partition("=")
            own = self.own_spelling(name)
            if own is not None:
                args[i] = own + eq + value
            elif name.startswith("--") and not self._abbreviates(name):
                self.unknown_flag(args[i], value_of=self._awaiting_value(args[i - 1]) if i else None)
        return args

    def _awaiting_value(self, token: str) -> str | None:
        """`token` when it is a flag of this parser whose value argparse expects next (not given with `=`)."""
        action = self._option_string_actions.get(self.own_spelling(token) or "") if _is_option(token) else None
        return token if action is not None and action.nargs != 0 and "=" not in token else None

    def own_spelling(self, name: str) -> str | None:
        """The flag of this parser `name` stands for (itself, its dashed form, the flag of the setting an ecosystem
        name means, an abbreviation in its dashed form: argparse resolves it or refuses an ambiguous one), or None."""
        known = self._option_string_actions
        if name in known or not name.startswith("--"):
            return name if name in known else None
        dashed = "--" + name[2:].replace("_", "-")
        if dashed in known:
            return dashed
        target = ecosystem_target(name, self._flag_of_setting())
        if target is not None:  # before abbreviations: `--output` means --out even where a flag begins with it
            return self._flag_of_setting()[target]
        return dashed if self._abbreviates(dashed) else None

    def unknown_flag(self, token: str, value_of: str | None = None) -> None:
        """Exit 2 with one line: the flag most likely meant (or that it was retired); `value_of`: the flag before it,
        still waiting for its value (`--vllm-arg --max-num-seqs=4` meant `--vllm-arg=--max-num-seqs=4`)."""
        name = token.partition("=")[0]
        if name.startswith("--") and spelling(name) in getattr(self, "retired", ()):  # add_settings_arguments' list
            self.exit(2, f"{self.prog}: error: unknown flag {name}: {retired_note(spelling(name))}\n")
        flags = {opt: opt for opt in self._option_string_actions if opt.startswith("--")}
        suggestion = closest(name, {**self._flag_of_setting(), **flags})
        hint = f"did you mean {suggestion.name}?" if suggestion else f"see {self.prog} --help"
        if suggestion and suggestion.note:
            hint += f" ({suggestion.note})"
        if value_of is not None:
            hint += f"; if it is the value of {value_of}, write {value_of}={token}"
        self.exit(2, f"{self.prog}: error: unknown flag {name}; {hint}\n")

    def format_help(self) -> str:
        if self._modes():  # a command of modes (evaluate): each mode's help says it
            return super().format_help()
        note = "Every flag also takes underscores for dashes (--a_flag for --a-flag)."
        other = self.other_spellings()
        if other:
            note += (" The names speculators, SpecForge and HF Trainer give these settings are accepted too: "
                     + "; ".join(f"{', '.join(names)} for {flag}" for flag, names in other.items()) + ".")
        width = max(40, min(120, shutil.get_terminal_size().columns) - 2)
        return (super().format_help() + "\n"
                + textwrap.fill(note, width, break_on_hyphens=False, break_long_words=False) + "\n")

    def other_spellings(self) -> dict[str, list[str]]:
        """{our flag: the ecosystem's names that this parser accepts for it}."""
        own, out = self._flag_of_setting(), {}
        for alias in ECOSYSTEM_ALIASES:
            flag, target = "--" + alias.replace("_", "-"), ecosystem_target(alias, own)
            if target is not None and flag not in self._option_string_actions:
                out.setdefault(own[target], []).append(flag)
        return out

    # --- what argparse will read ---------------------------------------------------------------------------------
    def _flag_of_setting(self) -> dict[str, str]:
        """{dest: its first `--` flag} of this parser's options."""
        out: dict[str, str] = {}
        for action in self._actions:
            long_flags = [o for o in action.option_strings if o.startswith("--")]
            if long_flags and action.dest not in (argparse.SUPPRESS, "help"):
                out.setdefault(action.dest, long_flags[0])
        return out

    def _modes(self) -> set[str]:
        return {name for a in self._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices}

    def _abbreviates(self, name: str) -> bool:
        return self.allow_abbrev and any(o.startswith(name) for o in self._option_string_actions if o.startswith("--"))

    def _option_indices(self, args: list[str]) -> Iterator[int]:
        """Indices of `args` that argparse reads as this parser's options: not their values, nor anything after
        `--`, a mode's name (its own parser reads the rest) or where a trailing positional starts (launch's
        `STAGE FLAGS...`)."""
        modes = self._modes()
        rest = any(not a.option_strings and a.nargs == argparse.REMAINDER for a in self._actions)
        takes_value = False
        for i, token in enumerate(args):
            if token == "--":
                return
            if _is_option(token):
                yield i
                takes_value = self._awaiting_value(args[i]) is not None
            elif takes_value:
                takes_value = False
            elif token in modes or rest:
                return


def _is_option(token: str) -> bool:
    return token.startswith("-") and token != "-" and " " not in token and not _NEGATIVE_NUMBER.match(token)
