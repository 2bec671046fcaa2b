"""Test your own setups: ``check_resume`` for pipelines, ``check_loader_resume`` for any
loader (a drop-in over your plain dataset, sampler and collate), and hypothesis strategies
(needs hypothesis). Example::

    def test_loader_resumes_exactly():
        check_loader_resume(lambda n: build_my_loader(num_workers=n), num_workers=2)
"""

from .compare import first_difference, samples_equal
from .resume import (
    END,
    ResumeMismatch,
    ResumeReport,
    check_loader_resume,
    check_resume,
    record_events,
)

__all__ = [
    "END",
    "ResumeMismatch",
    "ResumeReport",
    "check_loader_resume",
    "check_resume",
    "first_difference",
    "record_events",
    "samples_equal",
]
