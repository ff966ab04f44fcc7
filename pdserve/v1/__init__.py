"""Generated protobuf and gRPC stubs of the pdserve.v1 wire contract (protos/pdserve/v1).

Do not edit the ``*_pb2*.py[i]`` files: run ``make proto`` (scripts/gen_protos.py).
"""
