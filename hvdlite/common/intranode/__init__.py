"""intranode"""
