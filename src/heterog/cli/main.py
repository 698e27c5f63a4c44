"""Entry point of the `heterog` command. Each command lives in its own module exposing
`register(app)`; user errors print as one paragraph (a traceback only with --debug)."""

from __future__ import annotations

import importlib
import os
import sys

import typer

from heterog.errors import HeterogError

# One module per command family; each defines register(app: typer.Typer).
COMMAND_MODULES: tuple[str, ...] = (
    "capture_cmd",
    "plan_cmd",
    "predict_cmd",
    "simulate_cmd",
    "run_cmd",
)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan and run fast training on clusters of unlike GPUs.")
_state = {"debug": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors.")) -> None:
    _state["debug"] = debug


for _name in COMMAND_MODULES:
    importlib.import_module(f"heterog.cli.{_name}").register(app)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    debug = "--debug" in sys.argv
    try:
        app(standalone_mode=False)
    except HeterogError as e:
        if debug:
            raise
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except (typer.BadParameter, typer.Exit) as e:  # click usage errors
        raise e
    except Exception as e:  # noqa: BLE001 - click's own usage errors have .show()
        show = getattr(e, "show", None)
        if show is not None and not debug:
            show()
            sys.exit(getattr(e, "exit_code", 2))
        raise


if __name__ == "__main__":
    main()
