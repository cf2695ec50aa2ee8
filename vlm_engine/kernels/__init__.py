"""What every C++ CPU kernel shares: the CPU's ISA tier (`cpu_isa`) and building the extensions
(`build`). The attention op and the models' fused ops and linears both build on it; it imports
neither."""
