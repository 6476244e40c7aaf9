"""Version of the fpv2-serving wheel (moves independently of the sibling wheels)."""

__version__ = "0.1.14"
