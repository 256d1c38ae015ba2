"""Runnable experiments: thin command lines over the jaxtrain library."""
