"""Small host-to-device copies that never make the host wait for the device (:mod:`fpv2.index.transfer`).

Kept here under its earlier name: the serving modules and their users import it from
``fpv2.serving.transfer``; the implementation lives in the index wheel, whose dense
strategy needs it too.
"""

from __future__ import annotations

from fpv2.index.transfer import device_ints

__all__ = ["device_ints"]
