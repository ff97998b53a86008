"""The tools around the library: the ``tensorpar`` command, its local launcher and its reports.

``cli`` (the command's entry), ``launch`` (N local ranks through torch's elastic launcher, the
error-file handler), ``comm_report`` (``tensorpar comm``), ``bench`` and ``bench_variants``
(``tensorpar bench``) and ``gpu_check`` (``python -m tensorpar.tools.gpu_check``). Nothing in the
library imports from here; ``import tensorpar`` loads none of it.
"""
