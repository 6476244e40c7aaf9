"""Version of the fpv2-index wheel (moves independently of the sibling wheels)."""

__version__ = "0.1.7"
