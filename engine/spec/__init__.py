"""Speculative decoding: draft proposers and the policy deciding how many drafts pay."""
