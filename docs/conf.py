"""Sphinx configuration of jaxtrain's documentation: MyST Markdown pages, the API from the docstrings.

Build: ``make docs`` (warnings are errors: a broken reference or a missing API entry fails the build).
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "jaxtrain"
author = "the jaxtrain authors"
copyright = "2026, the jaxtrain authors"

# myst_nb: MyST Markdown (myst_parser's) and the notebook, rendered with the outputs it was saved with
# (d2l-multi-device.ipynb: tools/notebook-outputs executes examples/d2l_multi_device.ipynb into it)
extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
nb_execution_mode = "off"
exclude_patterns = ["_build", "README.md", "gpu-runs"]  # gpu-runs: the GPU runs' reports, data
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_typehints = "none"  # the signatures carry them; docstrings say what matters
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
nitpicky = False

html_theme = "sphinx_book_theme"
html_title = "jaxtrain"
html_theme_options = {"repository_url": "https://github.com/jaxtrain/jaxtrain", "use_repository_button": False,
                      "show_toc_level": 2}


def _check_api_reference(app):
    """A public name of ``jaxtrain`` missing from api.md is a warning (an error under -W)."""
    import jaxtrain
    from sphinx.util import logging

    text = open(os.path.join(app.srcdir, "api.md")).read()
    for name in jaxtrain.__all__:
        if f"jaxtrain.{name}\n" not in text:
            logging.getLogger(__name__).warning(f"jaxtrain.{name} is public (jaxtrain.__all__) but not in api.md")


def setup(app):
    app.connect("builder-inited", _check_api_reference)
