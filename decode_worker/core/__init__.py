"""Plain types every layer shares (requests, lifecycle states, policies, small utilities); imports no other
package of the worker.
"""
