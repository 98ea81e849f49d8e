"""Proposers: one module per speculative method; `factory.build_proposer` maps a config to one."""
