"""``--trainer-recovery replace``: the trainers as torchft replica groups at a quorum per step
(``replica``), a trainer process's epochs between quorum changes (``regroup``), and the launcher's
side: the Lighthouse and one trainer started again at a time (``supervisor``)."""
