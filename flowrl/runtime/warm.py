"""Dask worker preload: import what a role host needs before the worker registers.

Local workers start with ``preload=["flowrl.runtime.warm"]``, so a worker that the scheduler
lists is ready to host roles at once. That matters after a fault: a replacement or a standby
worker would otherwise spend seconds importing torch and transformers while the run waits
(measured on 2 cores: 4-5 s of a 5.5 s recovery). Workers of a cluster you start yourself
get the same with ``dask worker --preload flowrl.runtime.warm``.
"""

from __future__ import annotations

from typing import Any

import flowrl.runtime.checkpoint  # noqa: F401 - what a host imports when it first needs it
import flowrl.runtime.host  # noqa: F401 - torch and the host itself
import flowrl.roles.evaluate  # noqa: F401
import flowrl.roles.registry  # noqa: F401 - every role module
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification  # noqa: F401
from transformers.models.llama import modeling_llama  # noqa: F401 - the builtin models' class


def dask_setup(worker: Any) -> None:
    """Nothing to set up: importing this module was the point."""
