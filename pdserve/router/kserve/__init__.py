"""The KServe Open Inference Protocol v2 front door of the router (``inference.GRPCInferenceService``).

- :mod:`.tensors`: tensor contents (typed or raw) <-> Python values;
- :mod:`.convert`: ModelInferRequest -> pdserve.v1 GenerateRequest, output -> ModelInferResponse;
- :mod:`.servicer`: the servicer, on the same server and request path as ``pdserve.v1.Generation``.
"""
