"""attnprobe's version (``attnprobe.__version__``; pyproject.toml says the same). In the core, so that every room
can read it without importing the package's facade, which imports the rooms."""

__version__ = "0.1.0"
