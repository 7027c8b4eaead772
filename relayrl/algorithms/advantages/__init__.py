"""algorithms/advantages"""
