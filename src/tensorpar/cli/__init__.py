"""The tools around the library: the ``tensorpar`` command, its local launcher and its reports.

``cli`` (the command's entry) and ``training_cli`` (flags, checks and launch of train, generate,
export and prepare); ``launch`` (N local ranks through torch's elastic launcher, the error-file
handler) and ``errors`` (one-line errors, exit codes); ``comm_report``, ``comm_axes`` and ``comm_measure``
(``tensorpar comm``); ``bench`` and ``bench_variants`` (``tensorpar bench``); ``gpu_check`` and
``decode_check`` (``python -m tensorpar.cli.gpu_check``). Nothing in the library imports from
here; ``import tensorpar`` loads none of it.
"""
