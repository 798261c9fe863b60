"""Speed only, never new math: residual fusions, fp8, backend choice, attention backends, kernels."""
