"""Analysis of a study's trial table: the playbook's verdicts and the scientific comparison."""
