"""The `eagle3-train` command: one subcommand per pipeline stage.

Each stage module exposes `add_arguments(parser)` and `main(args)`; the Python API of a stage is the plain
function that `main` calls (see each module's docstring).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import sys

from eagle3_train import __version__
from eagle3_train.utils.io import Eagle3InputError
from eagle3_train.utils.stage_parser import StageParser
from eagle3_train.utils.suggest import closest

# subcommand -> (module, one-line help). Modules are imported only for the chosen subcommand.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("eagle3_train.pipeline", "run the whole pipeline from a YAML config (the README's main job)"),
    "convert-verifier": ("eagle3_train.assets.verifier", "make a plain HF checkpoint of a verifier (GGUF or HF)"),
    "prepare": ("eagle3_train.data.prepare", "tokenize conversations with the chat template and a loss mask"),
    "generate": ("eagle3_train.generate.regenerate", "regenerate assistant turns with the verifier's server"),
    "vocab": ("eagle3_train.vocab.build", "build the draft vocabulary (d2t/t2d) from token frequencies"),
    "extract": ("eagle3_train.hidden_states.extract", "store the verifier's aux and final hidden states"),
    "train": ("eagle3_train.train.cli", "train or finetune the draft with training-time test"),
    "export": ("eagle3_train.export.exporter", "export a checkpoint that vLLM and SGLang load"),
    "evaluate": ("eagle3_train.evaluate.cli", "measure acceptance length (offline or on a vLLM server)"),
    "serve": ("eagle3_train.serving.vllm_server", "start a vLLM server for the verifier (and a draft)"),
    "inspect": ("eagle3_train.export.inspect", "print a checkpoint's summary and lineage"),
    "adopt": ("eagle3_train.adopt", "take over an output directory that lists no files (an older version's, a copy)"),
    "launch": ("eagle3_train.launch", "print (or start here) the torchrun command of a run on several machines"),
    "plan": ("eagle3_train.plan", "estimate disk, transfer and memory of a run from the verifier config alone"),
}
# File-system failures that are the user's to fix (space, permissions), reported without a traceback.
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NOT_WRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}


def chosen_stage(argv: list[str]) -> str | None:
    """The subcommand named in `argv`, before parsing (only its module's arguments are added)."""
    return next((a for a in argv if a in SUBCOMMANDS), None)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3-train", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    # a stage's parser respells other spellings of its flags and answers an unknown one in one line
    sub = parser.add_subparsers(dest="stage", metavar="STAGE", parser_class=StageParser)
    chosen = chosen_stage(argv)
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser


def unknown_stage(argv: list[str]) -> str | None:
    """One line for a first argument that is no stage (argparse's answer is its usage and every choice), naming the
    stage most likely meant; None when argv names one (or none)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    if first is None or first in SUBCOMMANDS:
        return None
    suggestion = closest(first, list(SUBCOMMANDS))
    hint = f"did you mean '{suggestion.name}'?" if suggestion else "see eagle3-train --help"
    return f"eagle3-train: error: unknown command '{first}'; {hint}"


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a process of its own (not a call from Python): tune the heavy stages' host memory
        from eagle3_train.utils.host_memory import prepare_process

        prepare_process(chosen_stage(sys.argv[1:]), sys.argv[1:])
    argv = list(sys.argv[1:] if argv is None else argv)
    if (message := unknown_stage(argv)) is not None:
        print(message, file=sys.stderr)
        return 2
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per request drowns the progress bars
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not args.stage:
        parser.print_help()
        return 2
    module = importlib.import_module(SUBCOMMANDS[args.stage][0])
    try:
        result = module.main(args)
    except Eagle3InputError as e:
        print(f"eagle3-train {args.stage}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in _NO_SPACE | _NOT_WRITABLE:
            raise
        what = f" {e.filename}" if e.filename else ""
        hint = ("free some space (or choose another output directory) and rerun the same command: finished work is "
                "kept" if e.errno in _NO_SPACE else "choose a directory you can write to")
        print(f"eagle3-train {args.stage}: error: cannot write{what}: {e.strerror}; {hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"eagle3-train {args.stage}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
