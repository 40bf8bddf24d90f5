"""Python tests of the epmoe package. They import the package from python/ (or an installed
one) and its C library from EPMOE_C_LIBRARY when set (ctest points it at the build)."""
import os
import sys
from pathlib import Path

if "EPMOE_PACKAGE_DIR" in os.environ:
    sys.path.insert(0, os.environ["EPMOE_PACKAGE_DIR"])
elif not any(Path(p, "epmoe", "libepmoe_c.so").exists() for p in sys.path if p):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
