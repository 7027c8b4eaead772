"""experimental"""
