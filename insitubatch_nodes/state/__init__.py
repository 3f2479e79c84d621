"""What a checkpoint holds: the fingerprint a state is checked against, merging rank
states for an elastic resume, and the loader's state format checked field by field.
"""
