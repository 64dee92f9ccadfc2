"""The chaos suite: the controller, the Temporal server and the cloud API fail on purpose, and
jobs must still complete with no step lost, no node duplicated and nothing leaked."""
