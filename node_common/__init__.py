"""What both worker kinds share, and nothing else: the Ray actor base (:mod:`node_common.worker_actor`), the wire
messages between the front-end and the workers (:mod:`node_common.messages`, :mod:`node_common.prompt_wire`), and the
expert-cache policies a decode worker's tiers run (:mod:`node_common.expert_policies`, over
:mod:`node_common.expert_trace`). Imports only ``engine`` and ``kv_transfer`` (and third-party packages);
``prefill_node``, ``decode_node`` and ``cluster`` import it (``tests/test_layering.py`` keeps that true).
"""
