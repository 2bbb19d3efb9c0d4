"""Measurement harness: real fine-tuning runs under every method, per-rank peak-memory records (docs/harness.md).

Layers: ``__main__`` (Hydra, the only DictConfig) -> ``config`` (cfg -> RunSpec + HarnessOptions) ->
``launch`` (one point: plan, skip, run ranks, merge, table) -> ``worker`` (one rank: data, model, method,
steps, memory probe) with ``methods/``, ``data``, ``memory``, ``distributed``; records in ``records`` /
``table``. ``fake/`` (fake-tensor oracle) and ``tp`` (TP plans) are used by the methods. Importing this
package imports nothing heavy.
"""
