"""``python -m bert_cluster`` is the ``bert-cluster`` command (``accelerate launch -m bert_cluster ...``)."""

from bert_cluster.cli import main

main()
