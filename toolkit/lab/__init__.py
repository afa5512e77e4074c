"""The kernel lab: other kernels for the same recording (the kernels, booting one under QEMU, the §5 matrix)."""
