"""Our CPU kernels (C++ compiled at first use, called through ctypes) and their loaders."""
