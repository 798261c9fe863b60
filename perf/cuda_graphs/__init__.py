"""CUDA-graph capture and replay of a step's regions (capture.py) and the low-level state readers it
shares with the contract check (state.py; the check itself: tools/capture_contract.py)."""
