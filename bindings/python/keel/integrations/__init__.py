"""keel.integrations: Keel inside the trainers people use, one module per trainer.

- :mod:`keel.integrations.torchtitan`: Keel as the routed experts of torchtitan's ``MoE``
  (its router, shared experts and expert-bias balancing stay).
- :mod:`keel.integrations.deepspeed`: Keel as the experts and both all-to-alls of DeepSpeed's
  ``MOELayer`` (its ``TopKGate`` stays, with and without ``drop_tokens``).
- :mod:`keel.integrations.megatron`: Keel as the token dispatcher and the experts of
  Megatron-Core's ``MoELayer`` (its router, auxiliary losses and shared experts stay).

Each module checks the trainer's installed version when imported and refuses one outside the
range it was tested with. docs/integrations/README.md lists what works where.
"""
