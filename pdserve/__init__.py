"""pdserve command line and generated wire stubs"""
