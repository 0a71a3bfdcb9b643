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
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode", "vt_tutorials", "vt_figures"]
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "none"
nitpicky = False
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path = []
suppress_warnings = ["autodoc.import_object"]
