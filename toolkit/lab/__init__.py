"""The kernel lab: other kernels for the same recording (issue 11: kernels so far)."""
