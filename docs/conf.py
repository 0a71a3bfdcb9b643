"""Sphinx configuration for the vtnumba docs (built with -W: warnings are errors)."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
os.environ.setdefault("VTNUMBA_TARGET", "cpu")

project = "vtnumba"
author = "the vtnumba developers"
copyright = "2026, the vtnumba developers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode", "vt_tutorials", "vt_figures",
              "vt_api_check"]
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "none"
nitpicky = False
exclude_patterns = ["_build"]
# furo: a maintained, responsive theme -- code blocks use the width of the screen, the
# page's sections are in a sidebar, and every page ends with visible previous/next links.
html_theme = "furo"
html_title = "vtnumba"
html_static_path = []
pygments_style = "friendly"
pygments_dark_style = "monokai"
