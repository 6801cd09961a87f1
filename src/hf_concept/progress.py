"""Progress bars that stay out of logs: the one policy behind every bar the tools draw.

A bar redraws itself in place with carriage returns: right for a terminal, a flood of partial lines in a
file that stderr is redirected to. So a bar is drawn only when the stream it writes to (stderr unless told
otherwise) is a terminal, or in a notebook, whose bars are widgets that redraw in place. `progress_bar`
makes the tools' own bars so; `progress_disabled` tells Trainer's bar the same (`disable_tqdm`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tqdm import tqdm


def progress_disabled(stream: IO[str] | None = None) -> bool:
    """Whether a bar drawn on `stream` (stderr when None) must stay off: it is not a terminal, and this
    is not a notebook."""
    if _in_notebook():
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return not stream.isatty()
    except (AttributeError, ValueError):
        # No isatty, or a closed stream: nothing that could show a bar.
        return True


def progress_bar(iterable: Iterable[Any] | None = None, *, enabled: bool = True, **options: Any) -> tqdm:
    """A `tqdm.auto` bar over `iterable` (tqdm's `options`: desc, unit, total, file, leave, ...), off when
    `enabled` is False or when `progress_disabled` says so for its stream."""
    from tqdm.auto import tqdm

    disable = not enabled or progress_disabled(options.get("file"))
    return tqdm(iterable, disable=disable, **options)


def _in_notebook() -> bool:
    # The check tqdm.autonotebook makes: an IPython shell running inside a Jupyter kernel.
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})
