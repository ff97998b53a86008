"""The analytic models: what a layout communicates (:mod:`.communication`, :mod:`.context`,
:mod:`.pipeline`), what FSDP costs (:mod:`.fsdp`) and what a rank holds in memory (:mod:`.memory`).

They predict and plan; the axes' own code never imports them.
"""
