"""Helpers shared by the tests (never a test file importing another):

- :mod:`.dist`: run a function on N gloo processes and collect what each returns; hierarchical groups.
- :mod:`.models`: the tiny Hugging Face models the CPU tests train.
- :mod:`.training`: Trainer runs against single-process training (data, LightningModule, reference, comparison).
- :mod:`.references`: dense float64 attention; :mod:`.pattern_ref`: an independent pattern estimator;
  :mod:`.ops`: a block op that counts its calls; :mod:`.interpreter`: Triton-interpreter checks in a subprocess.
"""
