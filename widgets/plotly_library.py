"""plotly.js for the throughput view, shipped from the installed plotly package (no CDN: notebooks run offline).

The 4.8 MB library travels once per kernel: every ThroughputView references this one model, and the
front end loads the source from it the first time a plot is drawn on the page.
"""
from __future__ import annotations

from pathlib import Path

import anywidget
import plotly
import traitlets

PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


class PlotlyLibrary(anywidget.AnyWidget):
    _esm = "export default {};"           # a model only; nothing renders it
    _source = traitlets.Unicode("").tag(sync=True)


_library: PlotlyLibrary | None = None


def plotly_library() -> PlotlyLibrary:
    global _library
    if _library is None or _library.comm is None:   # closed models (Widget.close_all) are replaced
        if not PLOTLY_JS.is_file():
            raise FileNotFoundError(f"plotly.js is missing from the plotly package ({PLOTLY_JS}); "
                                    f"reinstall it with `pip install --force-reinstall plotly`.")
        _library = PlotlyLibrary(_source=PLOTLY_JS.read_text(encoding="utf-8"))
    return _library
