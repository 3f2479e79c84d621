"""Test utilities users can reuse: a moto S3 server on loopback and a fault-injecting proxy.

``s3server`` needs the ``dev`` extra (moto, boto3); ``faultproxy`` needs nothing.
"""
