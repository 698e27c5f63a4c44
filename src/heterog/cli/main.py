"""Entry point of the `heterog` command. Each command lives in its own module exposing
`register(app)`.

What a user sees when something goes wrong is decided here, in one place:
  - a usage mistake (unknown option, missing value, `--batch-size 0`) → one paragraph, exit 2;
  - a HeterogError (a bad file, an impossible plan, a failed rank) → one paragraph, exit 2;
  - SIGINT → exit 130, SIGTERM → exit 143 (128 + signal, as shells report them), with one
    line naming the command that was stopped and saying nothing partial was written (every
    file heterog writes goes through jsonio.write_atomic, and a checkpoint counts only once
    its completion marker exists);
  - anything else is a bug in heterog: one paragraph, exit 1.
`--debug` shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import warnings
from collections.abc import Iterator

import typer
from typer._click.exceptions import ClickException, NoArgsIsHelpError

from heterog import __version__
from heterog.cli.stop import STOP_REQUESTED, quiet_unraisable
from heterog.cli.stop import interrupt as _interrupt
from heterog.errors import HeterogError, HeterogWarning

# One module per command family; each defines register(app: typer.Typer).
COMMAND_MODULES: tuple[str, ...] = (
    "capture_cmd",
    "plan_cmd",
    "predict_cmd",
    "lower_cmd",
    "simulate_cmd",
    "run_cmd",
    "demo_cmd",
    "check_cmd",
    "whatif_cmd",
    "report_cmd",
    "profile_cmd",
    "calibrate_cmd",
)

EXIT_USAGE = 2
EXIT_BUG = 1

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Plan and run fast training on clusters of unlike GPUs.",
)
_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"heterog {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print heterog's version and exit."
    ),
) -> None:
    _state["debug"] = debug


for _name in COMMAND_MODULES:
    importlib.import_module(f"heterog.cli.{_name}").register(app)


def _command_name(argv: list[str]) -> str:
    words = [a for a in argv if not a.startswith("-")]
    return f"heterog {words[0]}" if words else "heterog"


def _paragraph(text: str) -> str:
    """Error text as one paragraph: lines joined, runs of spaces collapsed."""
    return " ".join(text.split())


@contextlib.contextmanager
def _signals_recorded() -> Iterator[list[int]]:
    """Turn SIGTERM into KeyboardInterrupt (so every `finally` cleans up, as for Ctrl-C) and
    record which signals arrived.

    The record comes from a wake-up pipe (signal.set_wakeup_fd), not from our handler: code
    deeper down (the local launcher) installs its own SIGTERM handler for the length of a
    run, and the C-level wake-up byte is written whichever Python handler runs.
    """
    seen: list[int] = []
    try:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        old_term = signal.signal(signal.SIGTERM, _interrupt)
        # SIGINT too: a process started by a shell's background job inherits it ignored,
        # and `kill -INT` must still stop it with exit 130
        old_int = signal.signal(signal.SIGINT, _interrupt)
    except ValueError:  # not the main thread (e.g. embedded): leave signals alone
        yield seen
        return
    STOP_REQUESTED.clear()
    old_hook = sys.unraisablehook
    sys.unraisablehook = quiet_unraisable(old_hook)
    try:
        yield seen
    finally:
        sys.unraisablehook = old_hook
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
        signal.set_wakeup_fd(old_fd)
        with contextlib.suppress(BlockingIOError):
            seen.extend(os.read(r, 64))
        os.close(r)
        os.close(w)


def _stopped(argv: list[str], seen: list[int]) -> int:
    signum = signal.SIGTERM if signal.SIGTERM in seen else signal.SIGINT
    what = _command_name(argv)
    extra = " and its ranks" if what == "heterog run" else ""
    typer.echo(f"{what}{extra} stopped by {signal.Signals(signum).name}; nothing partial was written.", err=True)
    return 128 + signum


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if issubclass(category, HeterogWarning):
        typer.echo(f"warning: {_paragraph(str(message))}", err=True)
    else:
        _previous_showwarning(message, category, filename, lineno, file, line)


_previous_showwarning = warnings.showwarning


def run_cli(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default sys.argv[1:]) and return its exit code; every
    error is printed to stderr as one paragraph (a traceback only with --debug)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    warnings.showwarning = _show_warning
    with _signals_recorded() as seen:
        try:
            code = app(args=argv, prog_name="heterog", standalone_mode=False)
        except KeyboardInterrupt:
            return _stopped(argv, seen)
        except NoArgsIsHelpError as e:
            typer.echo(e.format_message(), err=True)
            return EXIT_USAGE
        except ClickException as e:
            if debug:
                raise
            ctx = getattr(e, "ctx", None)
            cmd = ctx.command_path if ctx is not None else "heterog"
            text = _paragraph(e.format_message()).rstrip()
            text += "" if text.endswith((".", "?", "!")) else "."
            typer.echo(f"error: {cmd}: {text} See `{cmd} --help`.", err=True)
            return e.exit_code
        except typer.Abort:
            return _stopped(argv, seen)
        except HeterogError as e:
            if debug:
                raise
            typer.echo(f"error: {_paragraph(str(e))}", err=True)
            return EXIT_USAGE
        except Exception as e:  # noqa: BLE001 - a bug in heterog: say so in one paragraph, not a traceback
            if debug:
                raise
            typer.echo(
                f"internal error: {type(e).__name__}: {_paragraph(str(e))[:600]} — this is a bug in "
                f"heterog {__version__}; rerun with --debug for the traceback and report it.",
                err=True,
            )
            return EXIT_BUG
    if code == 130:  # typer turns a KeyboardInterrupt inside the command into Exit(130)
        return _stopped(argv, seen)
    return code if isinstance(code, int) else 0


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    sys.exit(run_cli())


if __name__ == "__main__":
    main()
