"""The store: what the gateway keeps of a session and a generation in Redis, and what it
admits there (sessions, the submitter, the admission, the queue, the models).
"""
