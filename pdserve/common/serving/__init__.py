"""Pieces the worker services share: the engine thread. No gRPC or protobuf here."""
