import os
import sys

# Tests import the packages from the repository root, whatever the working directory.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
