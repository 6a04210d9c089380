import os
import sys

# Tests import the packages from the repository root, whatever the working directory.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# The tests run many small ops; on a 2-core machine a second intra-op thread mostly adds contention
# (measured: the KDA reference step 10 ms with one thread, up to 175 ms with two under load).
torch.set_num_threads(1)
