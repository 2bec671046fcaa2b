"""Test your own pipelines: ``check_resume`` and hypothesis strategies (needs hypothesis).

Example, in your test suite::

    from energy_loader.testing import check_resume

    def test_pipeline_resumes_exactly():
        check_resume(build_my_pipeline, num_workers=2, epochs=2)
"""

from .compare import first_difference, samples_equal
from .resume import END, ResumeMismatch, ResumeReport, check_resume, record_events

__all__ = [
    "END",
    "ResumeMismatch",
    "ResumeReport",
    "check_resume",
    "first_difference",
    "record_events",
    "samples_equal",
]
