"""The kit's scripted tool trainer (`trl_credit.testing.tools`), under the name the host tests import."""

from trl_credit.testing.tools import *  # noqa: F401,F403
from trl_credit.testing.tools import __all__  # noqa: F401
