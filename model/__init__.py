"""The record #360 network as pure math (no kernels, no fp8 plumbing): see docs/design.md."""
